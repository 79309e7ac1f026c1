"""The run's web dashboard: training curves, throughput, the slot table, actors, live configuration, events.

Served by the run itself (the ``dashboard`` actor kind, ``ops.dashboard.actor``) or, for a finished or
remote run, by ``python -m ops.dashboard RUN_DIR``. Modules: ``model`` (what it knows, folded from
events and status samples), ``feeds`` (where that comes from), ``server`` (the HTTP side), ``static``
(the page, with uPlot vendored: nothing is fetched from outside at run time).
"""
