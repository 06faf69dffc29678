"""The measured HTTP path: an endpoint, the streaming client, the request client, the tokenizer. Imports only core."""
