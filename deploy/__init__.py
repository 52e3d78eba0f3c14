"""Scale-out: several `session-server` replicas behind one load balancer, and one admin plane over them.

- `replicas.py`: the replica list every command here takes (`--replica NAME=HOST:PORT`, repeated).
- `nginx.py`: the nginx config for N replicas (`python -m deploy.nginx`), from `nginx.conf.j2`: requests go to the
  replica that owns their session, new sessions to the least busy replica.
"""
