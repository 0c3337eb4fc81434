"""What the tests share: fixtures, helpers and throwaway services (``tests/`` is on pytest's
``pythonpath``, so a test imports ``from support.<module> import ...``).

| module | holds |
| --- | --- |
| ``ports`` | ``free_port``, ``port_open`` |
| ``databases`` | plugin: ``database``, ``database_url`` (SQLite and PostgreSQL), ``postgres_process``... |
| ``redis`` | plugin: ``redis_url``, ``redis_key_prefix``, ``redis_process``; ``RedisProcess`` |
| ``models`` | plugin: ``smollm2_dir``, ``tiny_dirs``; tiny random models of every family, GGUF files |
| ``gateway`` | plugin: ``gateway_engine``, ``peft_adapter_dir``; ``settings_for``, ``serving``, ``Admin`` |
| ``engines`` | ``make_engine``, ``tiny_engine`` (keyword overrides); the KV tier tests' drawn workload |
| ``adapters`` | PEFT adapters (``make_adapter``, ``make_peft_adapter``, ...) and ways to corrupt them |
| ``servers`` | uvicorn on loopback: ``start_server``, ``start_ui_server``; ``sse_lines``, ``wait_until`` |
| ``hostile`` | ``live``: a gateway in a thread of the test process (hostile-client tests); ``rss_bytes`` |
| ``replicas`` | gateway replicas as processes on one database and Redis (``start_replica``, ``Replica``) |
| ``speculation`` | copy prompts, ``run_checked`` (pool checked every step), the random speculation workload |
| ``drafts`` | ``make_layer_draft``: a model's first layers as a draft model (speculative decoding) |
| ``fidelity`` | HF greedy references and ``assert_greedy_match`` |
| ``admin_ui`` | signing in to the admin UI; Debian's chromium for the browser tests |
| ``rows`` | gateway database rows: ``make_tenant``, ``new_adapter``, ``fill`` (a big database) |
| ``kv_events`` | a KV event subscriber as a router writes one |
| ``kernels`` | naive math and random data for the kernel tests; ``swap_blocks``; ``random_packed`` |
| ``charts`` | rendering the Helm chart (``render``, ``VALUE_SETS``) |
| ``crd_schemas`` | schemas of the custom resources the chart renders |
| ``structured_schemas`` | JSON schemas of the structured-output tests, the hostile ones included |
| ``benchmarks`` | ``load_benchmark``: a ``benchmarks/*.py`` script as a module |
| ``processes`` | ``child_env``: a ``python -c`` child that imports ``support`` |

The plugins (fixtures of every test) are registered once, in ``pytest_plugins`` of tests/conftest.py.
"""
