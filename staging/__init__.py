"""Staging: the pool brings every node the job's data and model, by content.

`manifest` says what a tree of files is (paths relative to its root, sizes, sha256 per file and
per chunk; its digest names it), `cache` keeps verified copies in a node's state dir by content,
and `channel` moves chunks between nodes (and from dpctl into the pool) on a data socket of its
own, never the control socket (its server in `serve`, a fetch in `fetch`, dpctl's push in
`upload`). No MLX here, and no daemon: the daemon drives it.
"""
