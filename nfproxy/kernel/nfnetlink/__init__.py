"""The nfnetlink room's foundations (issue Q): `values` (datatypes, literals as bytes, set
types, names, one batch message) and `framing` (attributes, messages, the batch socket, the
walk over a reply). Imports go one way: these two import nothing else of the room; the encoders
(`declarations` for tables, chains, sets, maps and counters, `messages` for rules), the sender,
the batch compiler (kernel/nft_bulk.py) and the dump reader (kernel/nft_elements.py) build on
them, and tests/test_layout.py refuses a cycle between any two modules."""
