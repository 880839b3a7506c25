"""Text: tokenizers of model folders (`tokenizer`) and stop strings over streamed text (`stopping`)."""
