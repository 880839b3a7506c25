"""Training small models with lucebox's own forward: the built-in code model (`target`), its
sentencepiece tokenizer (`tokenizer_training`), and DFlash block drafters for any target
(`distill`). The forward that trains is the decoder the engine runs (`forward`), so a trained
model needs no conversion: it is saved as a Hugging Face folder and loaded like any other."""
