"""The built-in model families, registered (graphcp.model.family): the dense decoder
(with its MoE members), DSA, DeepSeek V4, the linear-attention hybrids and the KDA
hybrids (Kimi Linear, GLM-5-Next's text model).
``graphcp.model`` imports this module, so every program that reads a config has them."""

from __future__ import annotations

from graphcp.model.dense.family import DENSE
from graphcp.model.dsa.family import DSA
from graphcp.model.dsv4.family import DSV4
from graphcp.model.glm5_next.family import GLM5
from graphcp.model.hybrid.family import HYBRID
from graphcp.model.kimi_linear.family import KIMI

BUILT_IN = (DENSE, DSA, DSV4, HYBRID, KIMI, GLM5)
