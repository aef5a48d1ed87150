"""The end-to-end demo: a hybrid (sliding-window + full attention) model served by vLLM's CPU engine, with
LMCache reuse across fresh engines, cold vs warm, optionally compared with no connector and LMCache's server.

Everything heavy (vLLM, LMCache, transformers) is imported inside the functions that need it, and every engine
pass runs in its own subprocess, so importing this package stays cheap and no engine outlives its pass.
"""
