"""The test app's URLs plus status by key: ``django_idempotency.urls`` under ``keys/`` (the DRF
views, DRF being installed), and the plain Django views under ``plain-keys/``."""

from django.urls import include, path

from django_idempotency.request import status as views
from tests.testapp.urls import urlpatterns as testapp_urlpatterns

urlpatterns = [
    *testapp_urlpatterns,
    path("keys/", include("django_idempotency.urls")),
    path(
        "plain-keys/idempotency-keys/<path:key>/response",
        views.KeyResponseView.as_view(),
    ),
    path("plain-keys/idempotency-keys/<path:key>", views.KeyStatusView.as_view()),
]
