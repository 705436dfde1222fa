"""Model builders: meshrl's tiny locally built model and tokenizer, converted GGUF checkpoints, and
the chat templates meshrl ships."""
