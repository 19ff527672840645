"""flashtile's benchmarks: ``flashtile bench`` (``flashtile.bench.attention``: flashtile against its peers),
the one record format of every benchmark (``flashtile.bench.results``) and its plots
(``flashtile.bench.plot``)."""
