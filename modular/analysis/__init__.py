"""Analysis modules: behaviour-direction discovery and attention under token insertion."""
