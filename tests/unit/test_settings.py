"""Endpoints and URLs as they appear in logs and messages: never with a password."""

import pytest

from diloco.storage.errors import ConfigError
from diloco.storage.settings import Endpoints, redact_url


@pytest.mark.parametrize("url, shown", [
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ("redis://:s3cret@host:6379/0", "redis://:***@host:6379/0"),
    ("rediss://learner:s3cret@host:6380/0?ssl_ca_certs=/etc/ca%20dir/ca.pem&ssl_cert_reqs=required",
     "rediss://learner:***@host:6380/0?ssl_ca_certs=/etc/ca%20dir/ca.pem&ssl_cert_reqs=required"),
    ("rediss://learner@host/0", "rediss://learner@host/0"),
    ("redis://u:pa#s?s@w@host/0", "redis://u:***@host/0"),  # unescaped #, ? and @ in the password
    ("unix:///run/redis.sock?password=s3cret&db=2", "unix:///run/redis.sock?password=***&db=2"),
    ("rediss://host/0?ssl_password=s3cret", "rediss://host/0?ssl_password=***"),
    ("s3cret", "***"),
])
def test_redact_url_hides_passwords_and_keeps_the_rest(url, shown):
    assert redact_url(url) == shown


def test_endpoints_never_show_the_redis_password():
    e = Endpoints(redis_url="rediss://learner:s3cret@host:6380/0", bucket="b")
    assert "s3cret" not in repr(e) and "s3cret" not in str(e) and "learner:***@host" in repr(e)
    assert e.to_env()["DILOCO_REDIS_URL"] == e.redis_url  # children still get the real one
    with pytest.raises(ConfigError) as err:
        Endpoints(redis_url="http://learner:s3cret@host", bucket="b")
    assert "s3cret" not in str(err.value)


def test_s3_only_tools_need_no_redis_url_but_a_bus_refuses_to_start_without_one():
    from diloco.storage.bus import Bus

    env = {"DILOCO_S3_BUCKET": "b"}
    with pytest.raises(ConfigError, match="DILOCO_REDIS_URL"):
        Endpoints.from_env(env)
    e = Endpoints.from_env(env, redis=False)
    assert e.redis_url == "" and "DILOCO_REDIS_URL" not in e.to_env()
    with pytest.raises(ConfigError, match="no Redis configured"):
        Bus(e, "run")


def test_a_tls_client_checks_the_servers_hostname_whatever_redis_pys_default():
    """redis-py's default for `ssl_check_hostname` changed between releases: set it, never inherit it."""
    from diloco.storage.bus import connect

    tls = connect("rediss://u:p@127.0.0.1:6390/0?ssl_ca_certs=/tmp/ca.pem&ssl_cert_reqs=required")
    assert tls.connection_pool.connection_kwargs["ssl_check_hostname"] is True
    chosen = connect("rediss://127.0.0.1:6390/0?ssl_check_hostname=false")  # the operator's explicit choice
    assert chosen.connection_pool.connection_kwargs["ssl_check_hostname"] is False
    assert "ssl_check_hostname" not in connect("redis://127.0.0.1:6390/0").connection_pool.connection_kwargs
