"""Tools run from the command line and by the tests, above the runtime: they import it, it never imports them.

``demo/`` (the main job: a hybrid model served by vLLM, cold vs warm), ``soak`` (concurrent clients against
``vllm serve`` with constant eviction), ``engine`` and ``roundtrip`` (a real LMCache engine over our connector
outside vLLM, behind ``selftest``), ``fixtures`` (``materialize``: real tensors for a layout file).
"""
