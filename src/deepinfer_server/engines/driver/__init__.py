"""The engine driver's collaborators (`engines.llm_engine_driver.LLMEngineDriver` is the driver):
the LLMEngine contract and the request data it takes (`contract`), the reasoning budgets
(`budgets`), aborts DeepInfer could not place yet (`aborts`), speculative decoding's draft
counts (`drafts`) and the counters the rank reports (`readouts`: KV usage, prefix cache,
prompt tokens computed, prefill/decode transfers)."""
