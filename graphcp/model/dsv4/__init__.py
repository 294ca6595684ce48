"""DeepSeek V4 under prefill CP (docs/dsv4.md): the family's every part, its cache,
sparse attention, export format and transformers cache included (``family.py`` lists
them and registers them)."""
