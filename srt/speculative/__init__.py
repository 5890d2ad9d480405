"""Speculative decoding: a proposer drafts a few tokens per running request (n-gram lookup in the request's own
tokens, OpenAI Predicted Outputs, later a small STANDALONE draft model), the target model scores them all in
one extend step, and `verify` keeps the longest prefix that lossless rejection sampling accepts plus one more
token. EAGLE-style heads, which draft from the target model's own hidden states, are out of scope.

This `__init__` imports nothing: `defaults` is read by `ServerArgs`, whose process must not load torch.
"""
