"""The Ninja API of ``tests/testapp/ninja_api.py`` under ``ninja/``."""

from django.urls import path

from tests.testapp.ninja_api import api

urlpatterns = [path("ninja/", api.urls)]
