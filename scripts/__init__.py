"""Operator and benchmark scripts; a package so they import each other as `scripts.benchlib` (run them with
`python -m scripts.NAME` from the repository root)."""
