"""Text in, token batches out: corpus, tokenizer, pre-tokenized cache, samples and batches."""
