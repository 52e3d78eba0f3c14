"""Inference engines the session server fronts: the emulated SGLang engine and a real-SGLang launcher."""
