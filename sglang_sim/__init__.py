"""sglang-sim: an emulated SGLang engine that speaks SGLang's native HTTP API from a real process.

Real SGLang needs GPUs; this engine stands in for it in tests, demos and benchmarks. It keeps honest KV books
(a token-level radix cache over a fixed slot pool), generates deterministic replies in the model family's format,
and can inject faults. `sglang-sim --help` (or `python -m sglang_sim --help`) lists the flags.

Modules, one concept each:
- `kv_pool`       fixed pool of KV token slots (numpy free-list, double-free detection)
- `radix_cache`   token-level radix tree over the pool: prefix match, path locks, LRU eviction of unlocked leaves
- `generation`    deterministic reply planning from (seed, prompt ids, sampling_seed) and `[[sim: ...]]` directives
- `family`        the trajectory model family plus tokenizer facts the engine needs
- `requests`      `/generate` validation and the request record
- `images`        `image_data`: decoding, pad expansion (trajectory/image_grid.py), image-keyed radix keys
- `sessions`      streaming and non-streaming engine sessions (SGLang's session-controller rules)
- `engine`        the scheduler: admission against KV, timed emission, abort/pause/retract, one exit path
- `faults`        fault injection (`X-Sim-Fault` header, `POST /sim/faults`)
- `routed_experts` the optional routed-experts payload, built once per size
- `wire`          response shapes; `app` the Starlette routes; `cli` the command line
- `baseline`      what "nothing leaked" means for the soaks and tests that check the engine after a run

Endpoints: `POST /generate` (JSON or `stream: true` SSE), `POST /abort_request`, `POST /open_session`,
`POST /close_session`, `POST /pause_generation`, `POST /continue_generation`, `POST /flush_cache`,
`GET /health`, `GET /health_generate`, `GET /model_info` (`/get_model_info`), `GET /server_info`
(`/get_server_info`), `GET /v1/models`; test hooks `GET|POST /sim/faults` and `GET /sim/books` (KV invariants).

Scripted replies: the last message of the prompt that contains directives decides the reply:
`[[sim: think]]` (reasoning block), `[[sim: reply TEXT]]`, `[[sim: tokens N]]` (N words-tokens of content),
`[[sim: tool_call name=NAME args=JSON]]` (repeat for parallel calls). Without directives: seeded random words.
"""
