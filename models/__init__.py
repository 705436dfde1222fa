"""Model builders: meshrl's tiny locally built model and tokenizer."""
