"""`tandem serve`: an OpenAI-compatible HTTP server over the batched engine (tandem.engine).

    config.py         ServerConfig (frozen): bind address, limits, API key, served methods; each method's EngineConfig
    errors.py         APIError and the OpenAI error body {"error": {message, type, param, code}}
    schemas.py        the request records (pydantic, OpenAI field names) and their bounds
    chat_template.py  a checkpoint's jinja2 chat template (tokenizer_config.json) or the built-in one
    logprobs.py       LogprobEngine: the engine, recording the target's log-probabilities per new token
    driver.py         EngineDriver: ONE thread steps the engines; per-request events handed to asyncio
    engine_process.py ProcessDriver: the same driver in a spawned process of its own (--engine-process)
    metrics.py        Prometheus counters, gauges and histograms (one registry per server)
    app.py            the FastAPI app: routes, auth, body limit, streaming (server-sent events)
    runner.py         GracefulServer: uvicorn whose shutdown (SIGTERM) drains, then stops the engine
    cli.py            `tandem serve` (add_arguments / run)

Needs the `serve` extra: pip install 'tandem[serve]' (fastapi, uvicorn, prometheus_client, jinja2).
"""
