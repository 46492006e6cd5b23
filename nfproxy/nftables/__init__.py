"""nftables as data: typed objects, a Transaction of (verb, object), and the one text writer.

The knftables shape (docs/design.md): renderers build objects, a sync queues them in a
Transaction, and each kernel path consumes the Transaction its own way (libnftables through
`text.script`, nfnetlink by encoding the objects). Imports nothing but the standard library, so
backends, kernels and analysis can all share it.
"""

from nfproxy.nftables.objects import Chain, Counter, Element, Elements, Map, Note, Rule, Set, Table
from nfproxy.nftables.transaction import Transaction, Verb

# The one table nfproxy owns in each family (kube-proxy's is `kube-proxy`).
TABLE = "nfproxy"
# Service ports whose endpoint draw changes modulus with their weights live here, so that such a
# change rewrites rules in a small table and the kernel validates only that one
# (docs/nft-layouts.md, "Chains off the lane"). Created with its first such port, deleted with
# its last.
OFF_TABLE = "nfproxy-off"

__all__ = ["OFF_TABLE", "TABLE", "Chain", "Counter", "Element", "Elements", "Map", "Note", "Rule", "Set", "Table", "Transaction", "Verb"]
