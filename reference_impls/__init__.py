"""Reference engines: short, direct implementations the conformance suite is checked against."""
