"""What a KV transfer can end in. Every one is a run failure (a ``GraphcpError``, exit
code 1 on the command line) that names the request, the peer and the cause; none
loses KV: the prefill side keeps a request's KV until the receiver acknowledged it,
and a receiver never hands out a request it did not receive whole."""

from __future__ import annotations

from graphcp.errors import GraphcpError, InputError


class TransferError(GraphcpError, RuntimeError):
    """Base of the KV transport's errors."""


class TransportUnavailable(TransferError):
    """The transfer engine cannot be imported or started here (the ``pd`` extra or the
    system library it links is missing, or it refused to initialise)."""


class ReceiverUnreachable(TransferError):
    """Sender side: the receiver's control address did not answer within the timeout."""


class ReceiverDied(TransferError):
    """Sender side: the receiver closed its connection (or died) during a request."""


class TransferFailed(TransferError):
    """A transfer engine write failed, or the receiver refused or failed the request
    (another sender rank aborted or died, no room, a different model)."""


class TransferTimeout(TransferError):
    """A write, or a request's completion, did not finish within the timeout."""


class SenderDied(TransferError):
    """Receiver side: a sender rank's connection closed before it finished its part."""


class KVImportError(InputError):
    """``PrefillEngine.import_kv`` refused a payload (another model, format or dtype, a
    shape this engine cannot place); nothing was changed. Bad input: exit code 2."""
