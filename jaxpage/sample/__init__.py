"""On-device sampling."""
