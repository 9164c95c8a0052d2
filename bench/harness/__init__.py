"""What the tests and the suites share: servers on loopback and their process trees,
metrics scrapes, media origins and canaries, sample media, a throwaway redis-server and
the real vLLM engine (`realvllm`)."""
