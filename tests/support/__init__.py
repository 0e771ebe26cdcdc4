"""Test helpers shared by the test suites (real vLLM servers, ...)."""
