"""Checkpoint formats, all read as untrusted input: Hugging Face folders (`hf_folder`, with
`safetensors_file` checking every header), folders saved by `lucebox quantize` (`quantized`),
llama.cpp GGUF files (`gguf/`), and `loading`, which turns any of them into a `Decoder`."""
