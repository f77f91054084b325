"""``rlhf view``: a local web page about run directories (docs/runs.md), standard library only.

``logs`` reads a run's JSON-lines logs lazily (a step's lines by binary search, metrics by what
was appended), ``runs`` the runs given, ``server`` the loopback HTTP server and its guards,
``page`` the one page (assets in ``static/``, shipped with the package), ``export`` the page as one
self-contained file. Nothing here imports torch.
"""
