"""The decode engine: paged KV cache, scheduler, model runner, sampler, xgrammar guidance and streaming
detokenization. It can be driven without the request pipeline (``LLMEngine.add``/``step``).
"""
