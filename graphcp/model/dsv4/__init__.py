"""DeepSeek V4 under prefill CP (docs/dsv4.md)."""
