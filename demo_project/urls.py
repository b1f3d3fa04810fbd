from django.contrib import admin
from django.contrib.staticfiles.urls import staticfiles_urlpatterns
from django.urls import include, path
from django.views.generic import RedirectView
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.routers import DefaultRouter

from demo_project.payments.views import (
    AccountViewSet,
    DemoInfoView,
    LedgerEntryViewSet,
    PaymentViewSet,
    PayoutView,
)

router = DefaultRouter()
router.register("payments", PaymentViewSet)
router.register("accounts", AccountViewSet)
router.register("ledger", LedgerEntryViewSet)

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/demo/", DemoInfoView.as_view(), name="demo-info"),
    # 202 for a long operation: the payout is handed to a worker under the request's key.
    path("api/v1/payouts/", PayoutView.as_view(), name="payout-list"),
    path("api/v1/", include(router.urls)),
    # GET /api/v1/idempotency-keys/<key> and .../response: a client's own keys, by key.
    path("api/v1/", include("django_idempotency.urls")),
]

urlpatterns += [
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="swagger-ui"),
    path("", RedirectView.as_view(pattern_name="swagger-ui", permanent=False)),
]

# Admin and Swagger UI assets, straight from the apps while DEBUG is on (no collectstatic).
urlpatterns += staticfiles_urlpatterns()
