"""In-process micro-benchmarks: the one place outside the server's rooms allowed to import them.

Each module measures one piece from the inside (a kernel, the step transport, the scheduler's
router, a grammar engine, the offline LLM) and is run by hand as ``python -m pagedserve.loadtest.micro.NAME``,
or through `pagedserve bench throughput | latency | ipc`. None is a test and none is imported
by the server; the HTTP clients beside this package (loadtest/*.py) import nothing of the server.
"""
