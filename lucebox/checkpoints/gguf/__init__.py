"""llama.cpp GGUF files: the file (`file`), its metadata as a config.json (`config`), its tensors
under our names (`weights`) with their quantized blocks repacked (`blocks`), its tokenizer
(`tokenizer`), and the model as the loader sees it (`model`)."""
