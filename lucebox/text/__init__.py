"""Text: a model's tokenizer (`tokenizer`, built from a folder's files in `tokenizer_files`), chat templates
rendered in a bounded sandbox (`chat_template`), streamed detokenization (`incremental`) and stop strings over
streamed text (`stopping`)."""
