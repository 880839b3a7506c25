"""The engine behind `LLM`: its configuration, the runner of decode/verify steps, and the text
stage of a request. Kept free of imports here: the caches read this package's limits."""
