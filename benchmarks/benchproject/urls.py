from django.urls import path

from benchmarks.benchproject import views

urlpatterns = [
    path("api/v1/payments/", views.guarded_viewset().as_view({"post": "create"})),
    path("plain/payments/", views.PlainPaymentViewSet.as_view({"post": "create"})),
    path("get/", views.bare_get),
]
