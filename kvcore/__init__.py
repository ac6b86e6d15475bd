"""What every front end needs and nothing async: vLLM-exact tokenization, block hashing, the KV
event wire structs, the prefix index (C loops, pure twins, a reference model) and the dispatch ledger.
"""
