"""The pure inner ring: what every front end needs, and no I/O, asyncio or clock.

vLLM-exact tokenization, block hashing, the KV-event wire structs, the prefix index (C loops,
pure twins, a reference model) and the dispatch ledger (route, dispatch, first token, finish).
"""
