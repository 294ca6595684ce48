"""A batch's outputs made the pipeline's: each stage holds part of them (the last stage
the logits, a stage its own layers' auxiliary hidden states), and every rank of every
stage returns them all, broadcast from the stage that holds each (as the micro-batched
driver's are; here for a driver that assembled the whole batch on each stage: attention
DP's, graphcp.runtime.dp)."""

from __future__ import annotations

import torch

from graphcp.runtime.batch import PrefillOutput
from graphcp.runtime.outputs import per_request
from graphcp.runtime.pp.groups import PipelineGroups


def spread_outputs(pp: PipelineGroups, out: PrefillOutput, extend: list[int], all_logits: bool,
                   aux: tuple[int, ...], stage_layers: list[range], hidden: int, device: torch.device) -> PrefillOutput:
    """``out``: the batch's outputs on this stage (the logits where it is the last; its
    layers' columns of ``aux``, each request's ``[new_tokens, columns * hidden]``, where it
    holds any); ``extend``: each request's new tokens. Every field is then the pipeline's,
    the same on every rank."""
    last = pp.num_stages - 1
    mine = pp.stage == last
    out.last_logits = pp.broadcast(out.last_logits.contiguous(), last, device)
    if all_logits:
        flat = torch.cat(out.logits) if mine else torch.empty(sum(extend), out.last_logits.shape[1])
        out.logits = list(torch.split(pp.broadcast(flat, last, device), extend))
    if aux:
        full = torch.empty(sum(extend), len(aux), hidden)
        for s, layers in enumerate(stage_layers):
            held = [i for i in aux if i in layers]
            if not held:
                continue
            block = (torch.cat(out.aux_hidden).view(-1, len(held), hidden) if s == pp.stage
                     else torch.empty(sum(extend), len(held), hidden))
            full[:, [aux.index(i) for i in held]] = pp.broadcast(block, s, device)
        out.aux_hidden = per_request(full, extend)
    return out
