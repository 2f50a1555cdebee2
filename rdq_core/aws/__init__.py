"""AWS adapters: the only modules that speak to AWS services (boto3 comes with Lambda).

They depend on the vocabulary of ``rdq_core`` and nothing above it, so the engine may call them
and a host may choose them; the engine itself never imports boto3.
"""
