"""Build tools: the offline tokenizers (build_tokenizers), the tiny checkpoints (build_tiny_checkpoints) and the
real-SGLang launcher (launch_sglang). Run one as `python -m scripts.NAME` from the repository root; the benchmarks,
soaks and demos have folders of their own (benchmarks/, soaks/, examples/)."""
