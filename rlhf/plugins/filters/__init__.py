"""Built-in sample filters (``register_sample_filters``): ``dynamic``, DAPO's dynamic sampling."""
