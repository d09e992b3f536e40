"""The bytes of one batched operation: what is the same for every request of a policy is packed
into RESP once, and only a request's own values are packed per request.

Why a module of its own: an admission names about 25 KEYS and ARGV (the organization's rate
keys, limits, budget keys, counts), and packing them for every request was the largest part of
the gateway process's time per decision after the script itself (``bench/admission.py``).
Nearly all of them are fixed for a (key, model) policy, so ``decision`` asks this module for a
policy's frame once (cached on the policy, per month for budget keys) and appends the request's
few values (request id, estimate, worst-case cost; at settlement the actual counts) packed here.
The batcher (``runtime._Batcher``) joins the operations of one loop tick into ONE ``EVALSHA``
command without parsing or packing anything again.

An operation is ``Op``: (the key it is routed by on a Redis Cluster, the number of its KEYS,
its KEYS as RESP bulk strings, the number of its ARGV entries, its ARGV as RESP bulk strings),
its ARGV framed as ``scripts.STEP_LUA`` reads it: kind, KEYS count, ARGV count, then its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import hiredis

# (route key, KEYS count, KEYS, ARGV count with the framing, ARGV with the framing)
Op = tuple[str, int, bytes, int, bytes]


def bulks(values: Sequence[str | int]) -> bytes:
    """Return ``values`` as consecutive RESP bulk strings (the static parts: hiredis packs)."""
    if not values:
        return b""
    packed: bytes = hiredis.pack_command(tuple(values))  # type: ignore[arg-type]
    return packed[packed.index(b"\n") + 1:]  # without the array header "*<n>\r\n"


def bulk(value: str | int) -> bytes:
    """Return one value as a RESP bulk string (a request's own values)."""
    data = value.encode() if isinstance(value, str) else b"%d" % value
    return b"$%d\r\n%b\r\n" % (len(data), data)


def ints(values: Sequence[int]) -> bytes:
    """Return integers as consecutive RESP bulk strings."""
    return b"".join([b"$%d\r\n%b\r\n" % (len(d), d) for d in [b"%d" % v for v in values]])


class Frame:
    """The static part of one kind of operation of a policy: its KEYS, and the first of its
    ARGV (framing included); ``n_dynamic`` more ARGV values follow per request."""

    __slots__ = ("argv", "keys", "n_argv", "n_keys", "route")

    def __init__(self, kind: str, keys: Sequence[str], static: Sequence[str | int],
                 n_dynamic: int) -> None:
        self.route = keys[0]
        self.n_keys = len(keys)
        self.keys = bulks(keys)
        n_own = len(static) + n_dynamic
        self.n_argv = 3 + n_own
        self.argv = bulks([kind, len(keys), n_own, *static])

    def op(self, dynamic: bytes) -> Op:
        """Return the operation with this request's values (``n_dynamic`` bulk strings)."""
        return self.route, self.n_keys, self.keys, self.n_argv, self.argv + dynamic


def pack_op(kind: str, keys: Sequence[str], argv: Sequence[str | int]) -> Op:
    """Return an operation packed whole (calls made once, and the benchmark's no-op)."""
    return Frame(kind, keys, argv, 0).op(b"")


def evalsha(sha: bytes, batch: Sequence[Op]) -> bytes:
    """Return ONE ``EVALSHA`` of the script ``sha`` running ``batch`` in order (ARGV[1] is the
    count of operations, as ``scripts.STEP_LUA`` reads it)."""
    n_keys = n_argv = 0
    keys: list[bytes] = []
    argv: list[bytes] = []
    for _route, nk, k, na, a in batch:
        n_keys += nk
        keys.append(k)
        n_argv += na
        argv.append(a)
    head = b"*%d\r\n$7\r\nEVALSHA\r\n$%d\r\n%b\r\n" % (4 + n_keys + n_argv, len(sha), sha)
    return b"".join([head, bulk(n_keys), *keys, bulk(len(batch)), *argv])
