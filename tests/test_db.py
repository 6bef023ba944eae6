import pytest

from taskrunner.db import mask_url


@pytest.mark.parametrize("url,masked", [
    ("postgresql://app:s3cret@db:5432/app", "postgresql://app:***@db:5432/app"),
    ("postgresql://app:p@ss@db/app", "postgresql://app:***@db/app"),
    ("mysql://app:pa/ss@db/app", "mysql://app:***@db/app"),
    ("mysql://root@db/app", "mysql://root@db/app"),
    ("postgresql://db:5432/app", "postgresql://db:5432/app"),
    ("sqlite:///taskrunner.db", "sqlite:///taskrunner.db"),
])
def test_mask_url_hides_the_whole_password(url, masked):
    assert mask_url(url) == masked
