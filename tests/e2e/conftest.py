def pytest_configure(config):
    config.addinivalue_line("markers", "engine: starts a vLLM or oMLX engine (left out of the quick lane)")
