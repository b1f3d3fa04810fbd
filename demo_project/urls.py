from django.contrib import admin
from django.urls import include, path
from rest_framework.routers import DefaultRouter

from demo_project.payments.views import AccountViewSet, PaymentViewSet

router = DefaultRouter()
router.register("payments", PaymentViewSet)
router.register("accounts", AccountViewSet)

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/", include(router.urls)),
]
