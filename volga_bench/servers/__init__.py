"""Model servers that know nothing of Volga, which `volga bench server` and the tests freeze and wake."""
