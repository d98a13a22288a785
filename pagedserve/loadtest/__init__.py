"""Load generators and measurements that talk to a server over HTTP, as any client would.

`pagedserve bench serve` (bench.py), `bench soak` (soak.py), `bench startup` (bench_startup.py),
the locust user (locustfile.py), the workloads and their plots import nothing of the server
(app, engine, gpu, kernels): they run against pagedserve or any OpenAI-compatible server.
local_server.py starts `pagedserve serve` as a child process; it reads only contracts/ for
the default model's path. In-process micro-benchmarks, which do import the server, live in
loadtest/micro/. tests/test_layering.py holds both rules.
"""
