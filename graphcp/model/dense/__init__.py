"""The dense decoder family (Llama, Mistral, Qwen2, Qwen3) and its mixture-of-experts
members (Qwen3-MoE, Mixtral): the family object (``family.py``), the checkpoint's tensor
table and the presets' weights (``checkpoint.py``). Its layers are the shared decoder of
``graphcp/model/llama.py``, which the other families extend."""
