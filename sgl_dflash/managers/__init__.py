"""Scheduling and request bookkeeping: tokenizer manager, scheduler, requests and batches, detokenizer."""
