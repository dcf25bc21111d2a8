"""The guides' commands run as written and print what the guides show (tests/test_pages.py says how), in a
file of their own: the pages take minutes each, and the two files run on two workers at once."""

import pytest
from test_pages import GUIDES, check, name

pytestmark = pytest.mark.slow  # runs the guides' commands


@pytest.mark.parametrize("page", GUIDES, ids=name)
def test_every_command_a_guide_shows_runs_as_written_and_prints_what_it_shows(page, monim, tmp_path):
    check(page, monim, tmp_path)
